#include "bus/bus_link.h"

#include "dbus/dbus_service.h"
#include "event_source.h"
#include "moecache/log.h"

#include <sys/epoll.h>

#include <cerrno>
#include <cstring>

namespace moecache::daemon {

BusLink::BusLink(const Config& config, int epoll_fd) : config_(config), epoll_fd_(epoll_fd) {}

BusLink::~BusLink() = default;

void BusLink::start(Control& control) {
    control_ = &control;
    if (config_.dbus_bus != "off") connect();
}

void BusLink::retry() {
    if (service_ || control_ == nullptr || module_missing_ || config_.dbus_bus == "off") return;
    if (std::chrono::steady_clock::now() - last_try_ > std::chrono::seconds(kRetrySeconds)) connect();
}

void BusLink::connect() {
    last_try_ = std::chrono::steady_clock::now();
    auto b = DbusService::open(*control_, config_.dbus_bus, config_.dbus_admin_group);
    if (!b) {
        if (b.error().errnum == ELIBACC) {  // the module: trying again will not mend it
            module_missing_ = true;
            MC_LOG(LOG_WARNING,
                   "no D-Bus API ([dbus] bus = \"{}\"): {}; moecachectl cannot reach this daemon, "
                   "/metrics and the client socket work. Install the D-Bus module, or set [dbus] bus = \"off\"",
                   config_.dbus_bus, b.error().message);
            return;
        }
        if (!missing_said_)
            MC_LOG(LOG_WARNING, "no D-Bus API ([dbus] bus): {}; trying again every {} s", b.error().what(),
                   kRetrySeconds);
        missing_said_ = true;
        return;
    }
    epoll_event ev{};
    ev.events = (*b)->epoll_events();
    ev.data.u64 = event_data(EventSource::Bus, (*b)->fd());
    if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, (*b)->fd(), &ev) != 0) {
        MC_LOG(LOG_WARNING, "D-Bus: epoll_ctl add: {}", std::strerror(errno));
        return;
    }
    service_ = std::move(*b);
    events_ = ev.events;
    models_ = {UINT32_MAX, 0};
    MC_LOG(LOG_INFO, "D-Bus: org.moecache1 on the {} bus", service_->bus());
    missing_said_ = false;
}

void BusLink::lose() {
    (void)::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, service_->fd(), nullptr);
    MC_LOG(LOG_WARNING, "D-Bus: lost the {} bus: going on without the D-Bus API, connecting again every {} s",
           service_->bus(), kRetrySeconds);
    service_.reset();
    events_ = 0;
    missing_said_ = true;
    last_try_ = std::chrono::steady_clock::now();
}

void BusLink::process(bool ready) {
    if (service_ && (ready || service_->timeout_ms() == 0)) service_->process();  // setters request placement
}

void BusLink::sync(std::pair<uint32_t, size_t> shape) {
    if (!service_) return;
    if (service_->lost()) {
        lose();
        return;
    }
    if (shape != models_) {
        service_->sync_models();
        models_ = shape;
    }
    update_watch();
}

void BusLink::update_watch() {
    const uint32_t want = service_->epoll_events();
    if (service_->lost()) {
        lose();
        return;
    }
    if (want == events_) return;
    epoll_event ev{};
    ev.events = want;
    ev.data.u64 = event_data(EventSource::Bus, service_->fd());
    if (::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, service_->fd(), &ev) == 0)
        events_ = want;
    else
        MC_LOG(LOG_WARNING, "D-Bus: epoll_ctl: {}", std::strerror(errno));
}

int BusLink::timeout_ms() const { return service_ ? service_->timeout_ms() : -1; }

void BusLink::pressure_backoff(const std::string& source, uint64_t lock_cap) {
    if (service_) service_->pressure_backoff(source, lock_cap);
}

void BusLink::budget_changed(const std::string& name, uint64_t bytes) {
    if (service_) service_->budget_changed(name, bytes);
}

std::string BusLink::bus() const { return service_ ? service_->bus() : std::string(); }

}  // namespace moecache::daemon
